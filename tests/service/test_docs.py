"""The configuration reference in docs/ is generated from the config classes (no drift)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_up_to_date():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_config_doc.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
