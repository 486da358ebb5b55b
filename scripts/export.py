"""Export a trained draft and its target as a deployable bundle (transformers, vLLM, draftsmith's sampler).

    python scripts/export.py outputs/2026-11-29/19-59-20 --out bundles/smollm2-draft
    python scripts/export.py RUN_DIR/checkpoints/step800-alpha0.4812.ckpt --out bundle --copy-target
"""

import sys

from draftsmith.deploy.export import main

if __name__ == "__main__":
    sys.exit(main())
