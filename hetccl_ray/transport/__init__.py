"""Border transports: how data crosses between islands."""
