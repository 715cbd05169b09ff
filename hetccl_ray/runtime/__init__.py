"""Running plans: the runner, the small round with its call check, each op's run."""
