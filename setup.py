"""The build steps pyproject.toml cannot say: copy conf/, assets/toy and the paper reference into the
package (ddtree/_data/), so a wheel or a plain `pip install .` can compose configs and run the toy pair; and
compile the host tree build (ddtree/engine/_hosttree.c, plain C against Python's own API). It is optional: where
no compiler is found the install goes on and the engine takes its pure-Python build of the same trees."""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

SHIPPED = ("conf", "assets/toy", "docs/paper_reference.yaml")  # mirrors ddtree.paths.SHIPPED


class BuildWithData(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout itself
            return
        root = Path(__file__).resolve().parent
        data = Path(self.build_lib) / "ddtree" / "_data"
        for rel in SHIPPED:
            src, dst = root / rel, data / rel
            if src.is_dir():
                shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)


HOST_TREE = Extension("ddtree.engine._hosttree", ["ddtree/engine/_hosttree.c"], optional=True)

setup(cmdclass={"build_py": BuildWithData}, ext_modules=[HOST_TREE])
