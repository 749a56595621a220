"""`python -m trainer.config --markdown` writes docs/config.md."""

import sys

from trainer.config.reference import config_markdown

if sys.argv[1:] == ["--markdown"]:
    print(config_markdown(), end="")
else:
    print("usage: python -m trainer.config --markdown", file=sys.stderr)
    sys.exit(2)
