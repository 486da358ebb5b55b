"""Judge an engine's speculative decoding of an exported bundle against its target (lossless or not).

    python scripts/deploy_check.py bundles/smollm2-draft --engine transformers
    python scripts/deploy_check.py bundles/smollm2-draft --engine vllm --sampling 0.8:0.95 1.0
"""

import sys

from draftsmith.deploy.conformance import main

if __name__ == "__main__":
    sys.exit(main())
