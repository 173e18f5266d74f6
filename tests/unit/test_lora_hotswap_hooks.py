"""The hooks a compiled model's adapter swap puts into PEFT's hotswap module: re-entrant and thread-safe. Contexts
that overlap, on one thread or on several, each record their own thread's swaps, and once the last one closes
PEFT's own functions are back (no dead context's hook left behind to swallow later swaps)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("peft")
from peft.utils import hotswap  # noqa: E402

from model_worker.adapters.lora import _hotswaps  # noqa: E402


@pytest.fixture
def peft_functions(monkeypatch):
    """PEFT's two functions, stood in for by ones that record who was swapped (PEFT's own need a real model)."""
    swapped: list[str] = []

    def check(config0, config1) -> None:
        pass

    def swap(model, state_dict, adapter_name, config, *args, **kwargs) -> None:
        swapped.append(adapter_name)

    monkeypatch.setattr(hotswap, "check_hotswap_configs_compatible", check)
    monkeypatch.setattr(hotswap, "hotswap_adapter_from_state_dict", swap)
    return check, swap, swapped


def swap_through_peft(name: str) -> None:
    """What diffusers does: it looks the function up in `peft.utils.hotswap` at call time."""
    hotswap.hotswap_adapter_from_state_dict(object(), {}, name, object())


def test_overlapping_contexts_on_two_threads_record_their_own_swaps_and_leave_peft_as_it_was(peft_functions):
    check, swap, swapped = peft_functions
    a_open, b_open, a_closed, b_closed = (threading.Event() for _ in range(4))
    recorded: dict[str, list] = {}

    def thread_a() -> None:
        with _hotswaps() as swaps:
            swap_through_peft("slot-a")
            a_open.set()
            assert b_open.wait(10)
        recorded["a"] = [done[0] for done in swaps.done]
        a_closed.set()

    def thread_b() -> None:
        assert a_open.wait(10)
        with _hotswaps() as swaps:
            b_open.set()
            assert a_closed.wait(10)  # A's context has closed while B's is still open
            swap_through_peft("slot-b")
        recorded["b"] = [done[0] for done in swaps.done]
        b_closed.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert b_closed.is_set(), "a thread did not finish"
    assert len(recorded["a"]) == 1 and len(recorded["b"]) == 1, recorded  # each saw its own swap, once
    assert swapped == ["slot-a", "slot-b"]  # and PEFT's function did each swap once
    assert hotswap.check_hotswap_configs_compatible is check
    assert hotswap.hotswap_adapter_from_state_dict is swap


def test_a_nested_context_records_into_the_inner_one_and_a_thread_without_one_reaches_peft(peft_functions):
    check, swap, swapped = peft_functions
    with _hotswaps() as outer:
        with _hotswaps() as inner:
            swap_through_peft("inner")
        swap_through_peft("outer")
        bystander = threading.Thread(target=swap_through_peft, args=("bystander",))
        bystander.start()
        bystander.join(10)
    assert (len(inner.done), len(outer.done)) == (1, 1)
    assert swapped == ["inner", "outer", "bystander"]
    assert hotswap.hotswap_adapter_from_state_dict is swap and hotswap.check_hotswap_configs_compatible is check


def test_an_error_in_one_context_is_kept_by_that_context_alone(peft_functions):
    with _hotswaps() as failing:
        hotswap.check_hotswap_configs_compatible(_Config(use_dora=False), _Config(use_dora=True))
        with _hotswaps() as clean:
            swap_through_peft("clean")
    assert isinstance(failing.error, ValueError) and "use_dora True" in str(failing.error)
    assert clean.error is None and len(clean.done) == 1


class _Config:
    """A LoRA config with the keys PEFT's hotswap check compares."""

    def __init__(self, **values) -> None:
        from peft.utils import PeftType

        self.peft_type = PeftType.LORA
        for key in hotswap.CONFIG_KEYS_TO_CHECK[PeftType.LORA]:
            setattr(self, key, values.get(key))
