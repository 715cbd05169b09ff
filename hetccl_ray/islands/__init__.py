"""Island libraries: the vendor collective libraries (NCCL, RCCL, Gloo) and shared memory."""
