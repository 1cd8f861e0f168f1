"""What a wheel of lora_ops must hold beside its modules (setup.py's PACKAGE_DATA): an installed, not editable, copy
reads its data files from its own directory. Without op_table.json, `import lora_ops` raised FileNotFoundError
from a wheel before session 42 (the editable installs that the tests use read the source tree)."""
import glob
import os
import runpy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_data_file_of_the_package_goes_into_a_wheel():
    setup = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="lora_ops_setup")  # defines, does not build
    listed = set(setup["PACKAGE_DATA"]["lora_ops"])
    data = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "lora_ops", "*.json"))}
    assert {"op_table.json", "routes.json"} <= data
    assert data <= listed, f"not packaged: {sorted(data - listed)}"
