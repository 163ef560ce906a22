"""The digest of a framework function's body (what ds_lowcomm's copies of DeepSpeed and Megatron
functions record) is the same on every Python: from 3.12 on ``tokenize`` splits f-strings into
parts (PEP 701), which made every copied function with an f-string fail its check on the first
GPU machine (Python 3.12) with "has another body". Checked against the other Pythons on this
machine, each loading reflect.py alone (it imports nothing of ds_lowcomm at import)."""

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds_lowcomm.reflect import source_digest

REFLECT = Path(__file__).resolve().parents[1] / "ds_lowcomm" / "reflect.py"
SOURCE = '''def send(self, outputs, idx):
    # a comment, then nested and multi-line f-strings
    raise NotImplementedError('Could not send output of type '
                              f'{type(outputs)}' f"{idx!r:>{4}} {'x' if idx else f'{idx}'}")
    return f"""{outputs}
    spans {len(outputs)} lines"""
'''
PROBE = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('v', sys.argv[1]); "
         "v = importlib.util.module_from_spec(spec); sys.modules['v'] = v; spec.loader.exec_module(v); "
         "print(json.dumps(v.source_digest(sys.argv[2])))")


def other_pythons() -> list[str]:
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    found = {}
    for exe in sorted(glob.glob("/root/.pyenv/versions/3.1[0-9]*/bin/python3") + glob.glob("/usr/bin/python3.1[0-9]")):
        version = subprocess.run([exe, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                                 capture_output=True, text=True).stdout.strip()
        if version and version != mine:
            found.setdefault(version, exe)
    return list(found.values())


def test_digest_ignores_comments_and_layout_not_code():
    assert source_digest(SOURCE) == source_digest(SOURCE.replace("    # a comment, then nested and multi-line f-strings\n", ""))
    assert source_digest(SOURCE) != source_digest(SOURCE.replace("{type(outputs)}", "{outputs}"))


def test_digest_is_the_same_on_every_python():
    pythons = [exe for exe in other_pythons() if subprocess.run([exe, "-c", "import dataclasses"]).returncode == 0]
    if not any("3.12" in exe or "3.13" in exe for exe in pythons):
        pytest.skip("no Python 3.12 or later on this machine")
    mine = source_digest(SOURCE)
    for exe in pythons:
        out = subprocess.run([exe, "-c", PROBE, str(REFLECT), SOURCE], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == mine, exe
