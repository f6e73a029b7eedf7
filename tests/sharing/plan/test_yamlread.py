"""The fast YAML reader gives exactly what yaml.safe_load_all gives."""

from __future__ import annotations

import pytest
import yaml

from sharing.plan.yamlread import load_all

CASES = [
    "a: 0\nb: '0'\nc: x\nd: yes\ne: 1.5\nf: ~\ng:\nh: 0x10\ni: [1, 2, {j: k}]\n",
    "---\na: 1\n---\n---\nb: 2\n",
    "",
    "x: &a 1\ny: *a\n",  # anchors and aliases: the fallback
    "base: &b {a: 1}\nm:\n  <<: *b\n  c: 2\n",  # merge key
    "t: 2001-12-14\n",  # timestamp
    '{"apiVersion": "v1", "items": [{"a": 1, "b": true, "c": null, "d": "4Gi"}]}',
    "- a\n- b\n",
    "s: |\n  text\n  more\n",
    "!!str 5",
    "value: '100'\nother: 100\nq: 1e3\nneg: -7\n",
    "{a: 1, b: [x, y]}",  # flow-style YAML that is not JSON
    '[{"name": "gpu-0", "allowMultipleAllocations": true}]',
]


@pytest.mark.parametrize("text", CASES)
def test_same_as_safe_load_all(text: str) -> None:
    assert load_all(text) == list(yaml.safe_load_all(text))


def test_errors_are_yaml_errors() -> None:
    with pytest.raises(yaml.YAMLError):
        load_all("a: [1, 2\n")
