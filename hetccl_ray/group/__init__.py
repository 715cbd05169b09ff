"""The group: formation, options, rendezvous, progress, and HetCCLGroup (the op wrapper)."""
