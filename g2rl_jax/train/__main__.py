"""`python -m g2rl_jax.train --config FILE [key=value ...]`: see g2rl_jax/train/loop.py."""
from g2rl_jax.train.loop import main

raise SystemExit(main())
