"""CPU thread count of the model: one core is left to the event loop."""

import os
import threading

import pytest
import torch

from models import ModelSpec, load_model
from models.loading import cpu_threads
from models.testing import save_tiny_model


def test_default_leaves_one_cpu_to_the_event_loop():
    available = len(os.sched_getaffinity(0))
    assert cpu_threads(None) == max(1, available - 1)


@pytest.mark.parametrize("requested", [1, 3])
def test_explicit_count_wins(requested):
    assert cpu_threads(requested) == requested


def test_load_model_sets_the_threads_of_the_loading_thread(tmp_path):
    folder = save_tiny_model(tmp_path / "m")
    seen = []

    def load():  # as the server does: on the model thread
        load_model(ModelSpec(model=str(folder), device="cpu", num_threads=1))
        seen.append(torch.get_num_threads())
        torch.set_num_threads(3)
        load_model(ModelSpec(model=str(folder), device="cpu"))
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    thread = threading.Thread(target=load)
    thread.start()
    thread.join(60)
    torch.set_num_threads(before)
    assert seen == [1, cpu_threads(None)]
