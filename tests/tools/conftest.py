"""Import path for the tools' tests: tests/tools/load_tool.py (as tests/conftest.py does for tests/)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
