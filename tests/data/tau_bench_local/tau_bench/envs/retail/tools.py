"""The retail domain's tools, in tau-bench's form: `invoke(data, **arguments) -> str` and an OpenAI schema."""

from __future__ import annotations

import json

from tau_bench.envs.tool import Tool


def _schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


class FindUserIdByEmail(Tool):
    @staticmethod
    def invoke(data: dict, email: str) -> str:
        for user_id, user in data["users"].items():
            if user["email"].lower() == email.lower():
                return user_id
        return "Error: user not found"

    @staticmethod
    def get_info() -> dict:
        return _schema("find_user_id_by_email", "Find a user id by email.", {"email": {"type": "string"}}, ["email"])


class GetOrderDetails(Tool):
    @staticmethod
    def invoke(data: dict, order_id: str) -> str:
        order = data["orders"].get(order_id)
        return json.dumps({"order_id": order_id, **order}) if order else "Error: order not found"

    @staticmethod
    def get_info() -> dict:
        return _schema("get_order_details", "Get an order's status.", {"order_id": {"type": "string"}}, ["order_id"])


class CancelPendingOrder(Tool):
    @staticmethod
    def invoke(data: dict, order_id: str, reason: str) -> str:
        order = data["orders"].get(order_id)
        if order is None:
            return "Error: order not found"
        if order["status"] != "pending":
            return "Error: non-pending order cannot be cancelled"
        if reason not in ("no longer needed", "ordered by mistake"):
            return "Error: invalid reason"
        order.update(status="cancelled", cancel_reason=reason)
        return json.dumps({"order_id": order_id, **order})

    @staticmethod
    def get_info() -> dict:
        return _schema("cancel_pending_order", "Cancel a pending order.",
                       {"order_id": {"type": "string"}, "reason": {"type": "string"}}, ["order_id", "reason"])


ALL_TOOLS = [FindUserIdByEmail, GetOrderDetails, CancelPendingOrder]
