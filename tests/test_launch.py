"""`pagechat run`'s CPU thread policy: torch's pool leaves a core to the app unless OMP_NUM_THREADS chose."""

from __future__ import annotations

import pytest
import torch

from pagechat.tui.launch import leave_a_core_for_the_ui


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_pool_leaves_one_core_to_the_ui(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(4)
    assert leave_a_core_for_the_ui() == 3 and torch.get_num_threads() == 3
    torch.set_num_threads(1)
    assert leave_a_core_for_the_ui() is None and torch.get_num_threads() == 1  # never below one


def test_omp_num_threads_is_the_users_choice(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert leave_a_core_for_the_ui() is None and torch.get_num_threads() == 2
