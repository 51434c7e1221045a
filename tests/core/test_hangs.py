"""The account of a hung collective, as one process says it (the launches that produce it for
real are in tests/observe/test_hang_dumps.py)."""

from __future__ import annotations

from accelfn.core.hangs import Hang, is_hang_error, name_hang, raise_named

COLLECTIVE = {"seq": 12, "op": "gloo:all_reduce", "group": "default_pg", "group_id": "0",
              "ranks": [0, 1, 2, 3], "sizes": [[5]], "timeout_ms": 2000}


def test_the_account_names_the_collective_and_the_ranks_that_never_arrived():
    text = Hang(rank=0, collective=COLLECTIVE, absent=[3], behind={2: 11}, grace_s=1.0,
                dump="/runs/hang/rank_0").describe()
    assert text.startswith("rank 0 was in collective #12 (gloo:all_reduce, process group "
                           "'default_pg' of ranks [0, 1, 2, 3], sizes [[5]])")
    assert "rank 3 never arrived (no word within 1 s" in text
    assert "rank 2 was still at collective #11" in text
    assert "accelfn doctor --hang /runs/hang" in text
    every = Hang(rank=1, collective=COLLECTIVE).describe()
    assert "every rank of the group reached it" in every and "never arrived" not in every
    off = Hang(rank=1, collective=None, absent=[0, 2], grace_s=1.0).describe()
    assert "TORCH_FR_BUFFER_SIZE is 0" in off and "ranks 0, 2 never arrived" in off


def test_ranks_in_another_collective_at_the_same_number_are_named():
    # rank 0 all-gathers (an FSDP2 micro-batch) where rank 1 all-reduces (its update): they
    # all arrived, at different collectives
    text = Hang(rank=0, collective=COLLECTIVE,
                elsewhere={1: "gloo:all_gather (sizes [[46]])"}).describe()
    assert ("rank 1 was in gloo:all_gather (sizes [[46]]) as its collective #12: the "
            "processes ran different collectives") in text
    assert "every rank of the group reached it" not in text


def test_gloo_and_nccl_texts_of_a_hang_are_recognised_and_nothing_else():
    assert is_hang_error(RuntimeError("[../unbound_buffer.cc:78] Timed out waiting 2000ms for "
                                      "recv operation to complete"))
    assert is_hang_error(RuntimeError("[../pair.cc:534] Connection closed by peer [::1]:1234"))
    assert is_hang_error(RuntimeError("Watchdog caught collective operation timeout: "
                                      "WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"))
    assert not is_hang_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_hang_error(ValueError("Timed out waiting"))  # not torch's kind


def test_without_a_process_group_nothing_is_named_and_errors_pass_through():
    assert name_hang() is None
    assert raise_named(RuntimeError("Timed out waiting 5ms"), "reduce_metrics") is None


class _Store:
    """A store that every other rank already wrote its collective to."""

    def __init__(self, theirs: dict[str, str]) -> None:
        self.values = dict(theirs)

    def set_timeout(self, timeout) -> None:
        pass

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_the_exchange_tells_ranks_behind_from_ranks_in_another_collective(monkeypatch):
    import json

    from accelfn.core import compat_distributed, hangs

    def word(seq, op, sizes):
        return json.dumps({"seq": seq, "group": "0", "op": op, "sizes": sizes})

    store = _Store({f"{hangs._KEY}1": word(12, "gloo:all_gather", [[46]]),
                    f"{hangs._KEY}2": word(11, "gloo:all_reduce", [[5]]),
                    f"{hangs._KEY}3": word(12, "gloo:all_reduce", [[5]])})
    monkeypatch.setattr(compat_distributed, "default_store", lambda: store)
    absent, behind, elsewhere, note = hangs._exchange(0, COLLECTIVE, [0, 1, 2, 3], 0.1)
    assert (absent, behind, note) == ([], {2: 11}, None)
    assert elsewhere == {1: "gloo:all_gather (sizes [[46]])"}  # rank 3 is where rank 0 is
