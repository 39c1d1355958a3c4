"""The page's timeline legend names the kinds the last prefill reported, whatever the method's (it once knew
qkv/attn/o_ffn only, while the default method reports layer_attn/layer_ffn). Its script's pure part runs in Node."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources

import pytest

NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="no Node.js here to run the page's script (apt-get install nodejs)")
@pytest.mark.parametrize("kinds", [["layer_attn", "layer_ffn"], ["qkv", "attn", "o_ffn"], ["layer"]])
def test_the_legend_shows_the_reported_kinds_each_in_its_own_color(kinds):
    page = resources.files("hetero.serve").joinpath("page.html").read_text(encoding="utf-8")
    script = re.search(r"// <kinds>.*// </kinds>", page, flags=re.S).group(0)
    nodes = [[chunk, layer, kind, "npu", 0, 1] for chunk in range(2) for layer in range(2) for kind in kinds]
    out = subprocess.run([NODE, "-e", script + f"\nconsole.log(JSON.stringify(kindsOf({json.dumps(nodes)})"
                                                ".map((k) => [k, color(k)])))"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    got = json.loads(out)
    assert [k for k, _ in got] == kinds
    assert len({c for _, c in got}) == len(kinds) and all(re.fullmatch(r"#[0-9a-f]{6}", c) for _, c in got)
    assert '<div class="legend" id="legend"></div>' in page  # nothing hard-coded: drawn from the reported kinds
