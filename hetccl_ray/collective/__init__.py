"""The hetccl collective group: plans over island communicators and a border."""
