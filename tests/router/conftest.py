"""Router tests run real processes: `pagoda route` in front of small real uvicorn engines
(fake_engine.py) or real `pagoda serve` replicas. The process harness is shared with e2e/local."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))
