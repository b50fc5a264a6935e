"""The retail domain's database: users and their orders (a fresh copy per episode)."""

from __future__ import annotations

import copy

DATA = {
    "users": {
        "mia_li_3668": {"name": "Mia Li", "email": "mia.li3818@example.com", "orders": ["#W0001", "#W0002"]},
        "noah_kim_2040": {"name": "Noah Kim", "email": "noah.kim@example.com", "orders": ["#W0003"]},
        "ava_ruiz_7714": {"name": "Ava Ruiz", "email": "ava.ruiz@example.com", "orders": ["#W0004"]},
    },
    "orders": {
        "#W0001": {"user_id": "mia_li_3668", "status": "pending", "items": ["desk lamp"], "total": 34.5},
        "#W0002": {"user_id": "mia_li_3668", "status": "delivered", "items": ["kettle", "mug"], "total": 52.0},
        "#W0003": {"user_id": "noah_kim_2040", "status": "pending", "items": ["backpack"], "total": 79.99},
        "#W0004": {"user_id": "ava_ruiz_7714", "status": "processed", "items": ["headphones"], "total": 120.0},
    },
}


def load_data() -> dict:
    return copy.deepcopy(DATA)
