"""Everything is in pyproject.toml except one file that setuptools cannot place from there: jaxinfer_lm_eval.pth.

lm-eval 0.4.13 has no plugin discovery: `lm_eval --model NAME` looks only in its own table. The .pth file, at the
top of site-packages, runs `jaxinfer.lm_eval_hook` at interpreter start-up; the hook adds "jaxinfer" to that table
when lm-eval builds it (and does nothing otherwise). Both the wheel and the editable install (`pip install -e`,
what `make` does) carry the file.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "jaxinfer_lm_eval.pth"


class BuildPy(build_py):
    """The wheel: the .pth file goes beside the packages."""

    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH))

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


class _WithPth:
    """Wraps setuptools' editable strategy (a context manager called with the wheel) to add the .pth file."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, Path(PTH).read_bytes())

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


class EditableWheel(editable_wheel):
    """The editable install: setuptools ships only its own path hook, so the .pth file is added to that wheel."""

    def _select_strategy(self, *args, **kwargs):  # setuptools' hook point for what the editable wheel holds
        return _WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
