"""The doors users reach the group through: ray.util.collective, torch.distributed, Ray Train, Ray Direct Transport."""
