"""pdserve.common.native.build_shared: each unit its own object (one file may be built twice
with flags of its own, as the kernels' per-K/V-type halves are), compiled side by side, linked
into the target atomically; a failed build leaves neither the target nor its objects."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
from pdserve.common.native import build_shared, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="needs a C compiler")

SOURCE = """
#ifdef AS_TWO
int answer_two(void) { return 2; }
#else
int answer_one(void) { return 1; }
#endif
"""


def test_one_source_built_as_two_objects_gives_both_symbols(tmp_path):
    source = tmp_path / "answer.c"
    source.write_text(SOURCE)
    target = tmp_path / "out" / "libanswer.so"
    build_shared(compiler(), [(source, ()), (source, ("-DAS_TWO",))], target,
                 ("-O1", "-shared", "-fPIC"))
    lib = ctypes.CDLL(str(target))
    assert (lib.answer_one(), lib.answer_two()) == (1, 2)
    assert [p.name for p in target.parent.iterdir()] == ["libanswer.so"]  # no objects left


def test_a_unit_that_does_not_compile_leaves_nothing(tmp_path):
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text(SOURCE)
    bad.write_text("int broken(void) { return }\n")
    target = tmp_path / "out" / "libbroken.so"
    with pytest.raises(subprocess.CalledProcessError) as failed:
        build_shared(compiler(), [good, bad], target, ("-O1", "-shared", "-fPIC"))
    assert "bad.c" in failed.value.stderr
    assert list(target.parent.iterdir()) == []
