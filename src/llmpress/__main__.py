import sys

from llmpress.cli import main

sys.exit(main())
