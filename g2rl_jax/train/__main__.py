"""`python -m g2rl_jax.train --config FILE [key=value ...]`: see g2rl_jax/train/command.py."""
from g2rl_jax.train.command import main

raise SystemExit(main())
