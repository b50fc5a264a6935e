"""The retail domain's tasks per split: a customer instruction and its ground truth (actions, or outputs to say)."""

from __future__ import annotations

from tau_bench.types import Action, Task

_CANCEL = Task(
    user_id="mia_li_3668",
    instruction="You are Mia Li (mia.li3818@example.com). Cancel your pending order #W0001: you no longer need it.",
    actions=[Action(name="find_user_id_by_email", kwargs={"email": "mia.li3818@example.com"}),
             Action(name="cancel_pending_order", kwargs={"order_id": "#W0001", "reason": "no longer needed"})],
    outputs=[],
)
_STATUS = Task(
    user_id="ava_ruiz_7714",
    instruction="You are Ava Ruiz. Ask for the status of your order #W0004 and end once you are told.",
    actions=[Action(name="get_order_details", kwargs={"order_id": "#W0004"})],
    outputs=["processed"],
)
_MISTAKE = Task(
    user_id="noah_kim_2040",
    instruction="You are Noah Kim (noah.kim@example.com). You ordered your backpack (#W0003) by mistake: cancel it.",
    actions=[Action(name="cancel_pending_order", kwargs={"order_id": "#W0003", "reason": "ordered by mistake"})],
    outputs=[],
)

TASKS = {"train": [_CANCEL, _STATUS], "dev": [_MISTAKE], "test": [_MISTAKE, _STATUS]}
