"""The README's op example runs as written (on the CPU), so that the API it shows stays true."""
import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_the_ops_example_runs():
    text = open(README, encoding="utf-8").read()
    block = re.search(r"## The ops\n+```python\n(.*?)```", text, flags=re.S)
    assert block, "README.md has no python block under '## The ops'"
    exec(compile(block.group(1), "README.md (The ops)", "exec"), {})
