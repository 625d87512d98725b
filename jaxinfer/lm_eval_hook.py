"""Adds "jaxinfer" to lm-eval's model table when lm-eval builds it, so `lm_eval --model jaxinfer` works.

lm-eval 0.4.13 looks a `--model` name up only in its own table (`lm_eval.models.MODEL_MAPPING`, turned into
lazy registry entries when `lm_eval.models` is imported); it has no plugin discovery. `jaxinfer_lm_eval.pth`,
installed at the top of site-packages by setup.py, calls `install()` at interpreter start-up. That puts a
finder on `sys.meta_path` which waits for `lm_eval.models`, lets the usual finders load it, and then adds a
lazy entry pointing at `jaxinfer.lm_eval_model:JaxinferLM`. Nothing is imported until lm-eval itself is, and
a failure here only warns: lm-eval's other models keep working.
"""

import sys

WATCHED = "lm_eval.models"
NAME = "jaxinfer"
TARGET = "jaxinfer.lm_eval_model:JaxinferLM"


def install() -> None:
    """Puts the finder first on sys.meta_path, once."""
    if not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def register() -> None:
    """The lazy entry; lm-eval imports jaxinfer.lm_eval_model only when the model is asked for."""
    from lm_eval.api.registry import model_registry  # noqa: PLC0415  (lm-eval is being imported already)

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _RegisterAfterImport:
    """A meta-path finder that answers only for lm_eval.models, with the real spec and a loader that registers."""

    def find_spec(self, name, path=None, target=None):
        if name != WATCHED:
            return None
        import importlib.util  # noqa: PLC0415  (only when lm-eval is imported)

        sys.meta_path.remove(self)  # one use: find the real spec, and never come back
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader:
    """The real loader, then `register()`."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        try:
            register()
        except Exception as error:  # noqa: BLE001  (lm-eval must keep working without this model)
            import warnings  # noqa: PLC0415

            warnings.warn(f"jaxinfer: could not add the 'jaxinfer' model to lm-eval's table: {error}", stacklevel=2)

    def __getattr__(self, name):
        return getattr(self.loader, name)
