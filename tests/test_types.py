"""The plain data's byte counts (fedweave.types): what a dense wire format would carry."""

from __future__ import annotations

import torch

from fedweave.types import (
    Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work, body_nbytes, messages_nbytes,
)


class Counted(dict[str, torch.Tensor]):
    """A mapping of tensors that counts how often its tensors are listed."""

    reads = 0

    def values(self):  # type: ignore[override]
        Counted.reads += 1
        return super().values()


def test_a_round_s_messages_count_every_body_and_a_shared_broadcast_is_measured_once() -> None:
    broadcast = Counted(w=torch.zeros(3, 2), b=torch.zeros(2, dtype=torch.float64))  # 24 + 16 bytes
    own = Update(UpdateKind.DELTA, {"w": torch.zeros(3, 2)}, 5, extras={"c": torch.zeros(4, dtype=torch.int8)})
    messages = [
        Message(1, 0, Instruction(1, TaskKind.TRAIN, Work(0, 4), broadcast)),
        Message(1, 1, Instruction(1, TaskKind.TRAIN, Work(1, 4), broadcast)),
        Message(1, 2, own),
        Message(1, 3, Evaluation(num_examples=2, metrics={"accuracy": 0.5})),
    ]
    assert [body_nbytes(m.body) for m in messages] == [40, 40, 28, 0]
    Counted.reads = 0
    assert messages_nbytes(messages) == 108
    assert Counted.reads == 1  # the broadcast's tensors listed once for both instructions
