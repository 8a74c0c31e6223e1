"""Convert a Hugging Face Qwen3 target, or an EAGLE-3 drafter (--drafter-of TARGET), into an orbax
folder that `load_target` / `load_drafter` read faster (and without torch for .bin drafters).

    python convert/convert_checkpoint.py SRC DST [--dtype bfloat16] [--drafter-of TARGET]

The same as `eagle3-jax convert`.
"""

import sys

from eagle3_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
