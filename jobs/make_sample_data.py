"""Generate the sample dataset: e-commerce click and order events as JSON lines.

    python jobs/make_sample_data.py                      # writes jobs/data/events.jsonl
    python jobs/make_sample_data.py --rows 50000 --seed 7 --out /tmp/events.jsonl

Deterministic: the same --seed and --rows give the same bytes. The events span two hours
of a shop's morning; a few percent arrive out of order (up to 4 minutes late, well inside
the streaming ETL's 10-minute watermark), and a handful of lines are deliberately
malformed (truncated JSON, plain text, missing or mistyped fields) so the ETL's
dead-letter path has something to catch. A manifest next to the output records how many
lines of each kind were written.

Fields of a good event:
    event_id    "evt-000001"            unique
    event_time  "2026-03-14T09:00:03.120Z"   ISO 8601, UTC
    user_id     "u-0042"
    session_id  "s-00042-3"
    event_type  page_view | add_to_cart | remove_from_cart | purchase | refund
    product_id  "p-1007"
    category    electronics | books | home | fashion | toys | grocery
    quantity    integer (null for page_view)
    amount      number, EUR (null for page_view; negative for refund)
    currency    "EUR"
    country     ISO 3166 code
    device      desktop | mobile | tablet
"""
from __future__ import annotations

import argparse
import json
import os
import random
from datetime import UTC, datetime, timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "data", "events.jsonl")
START = datetime(2026, 3, 14, 9, 0, 0, tzinfo=UTC)
SPAN_SECONDS = 2 * 3600
EVENT_TYPES = ("page_view", "add_to_cart", "remove_from_cart", "purchase", "refund")
EVENT_WEIGHTS = (62, 18, 4, 14, 2)
CATEGORIES = {  # category: (price low, price high)
    "electronics": (19.0, 899.0),
    "books": (6.0, 45.0),
    "home": (9.0, 240.0),
    "fashion": (12.0, 180.0),
    "toys": (5.0, 90.0),
    "grocery": (1.5, 35.0),
}
COUNTRIES = ("DE", "FR", "NL", "ES", "IT", "PL", "SE", "AT", "BE", "IE")
COUNTRY_WEIGHTS = (30, 20, 10, 10, 9, 7, 5, 4, 3, 2)
DEVICES = ("mobile", "desktop", "tablet")
DEVICE_WEIGHTS = (58, 35, 7)
LATE_FRACTION = 0.04
MAX_LATENESS_SECONDS = 240


def iso(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z"


def good_events(rng: random.Random, rows: int) -> list[dict]:
    users = [f"u-{i:04d}" for i in range(1, max(50, rows // 12) + 1)]
    products = {cat: [f"p-{1000 + 100 * i + j}" for j in range(1, 41)] for i, cat in enumerate(CATEGORIES)}
    prices = {p: round(rng.uniform(*CATEGORIES[cat]), 2) for cat, ps in products.items() for p in ps}
    user_country = {u: rng.choices(COUNTRIES, COUNTRY_WEIGHTS)[0] for u in users}
    user_device = {u: rng.choices(DEVICES, DEVICE_WEIGHTS)[0] for u in users}
    session_count: dict[str, int] = {}

    # Arrival times: a morning ramp (more traffic later), sorted.
    offsets = sorted(SPAN_SECONDS * (rng.random() ** 0.8) for _ in range(rows))
    events = []
    for n, offset in enumerate(offsets, start=1):
        user = rng.choice(users)
        session_count.setdefault(user, rng.randint(1, 3))
        if rng.random() < 0.05:
            session_count[user] += 1
        category = rng.choice(list(CATEGORIES))
        product = rng.choice(products[category])
        event_type = rng.choices(EVENT_TYPES, EVENT_WEIGHTS)[0]
        quantity = amount = None
        if event_type != "page_view":
            quantity = rng.choices((1, 2, 3, 4), (70, 18, 8, 4))[0]
            amount = round(prices[product] * quantity, 2)
            if event_type == "refund":
                amount = -amount
        event_time = START + timedelta(seconds=offset)
        events.append({
            "event_id": f"evt-{n:06d}",
            "event_time": iso(event_time),
            "user_id": user,
            "session_id": f"s-{user[2:]}-{session_count[user]}",
            "event_type": event_type,
            "product_id": product,
            "category": category,
            "quantity": quantity,
            "amount": amount,
            "currency": "EUR",
            "country": user_country[user],
            "device": user_device[user],
        })
    # Out of order: a few events arrive later than their event time says (mobile clients
    # flushing a buffer): move each one further down the file, by up to 4 minutes of traffic.
    times = [START + timedelta(seconds=o) for o in offsets]
    for index in sorted(rng.sample(range(len(events)), int(len(events) * LATE_FRACTION)), reverse=True):
        lateness = timedelta(seconds=rng.uniform(20, MAX_LATENESS_SECONDS))
        target = index
        while target + 1 < len(events) and times[target + 1] - times[index] < lateness:
            target += 1
        if target != index:
            event = events.pop(index)
            events.insert(target, event)
            times.insert(target, times.pop(index))
    return events


def malformed_lines(rng: random.Random, events: list[dict]) -> list[tuple[str, str]]:
    """(kind, line) pairs: each is a line the ETL must send to its dead-letter output."""
    def pick() -> dict:  # a copy of a real event, under an id of its own
        event = dict(rng.choice(events))
        event["event_id"] = f"evt-9{len(picked) + 1:05d}"
        picked.append(event)
        return event

    picked: list[dict] = []
    sample = pick()
    as_json = json.dumps(sample, separators=(",", ":"))
    bad = [
        ("truncated_json", as_json[: len(as_json) // 2]),
        ("truncated_json", json.dumps(pick())[:-1]),
        ("not_json", "GET /checkout?cart=8812 HTTP/1.1 200"),
        ("not_json", "event_type=purchase amount=12.99 user=u-0007"),
        ("empty_object", "{}"),
        ("json_array", json.dumps([sample["event_id"], sample["event_time"], sample["amount"]])),
        ("missing_event_time", json.dumps({k: v for k, v in pick().items() if k != "event_time"})),
        ("missing_user_id", json.dumps({k: v for k, v in pick().items() if k != "user_id"})),
        ("bad_event_time", json.dumps({**pick(), "event_time": "14/03/2026 09:31"})),
        ("bad_event_time", json.dumps({**pick(), "event_time": "yesterday"})),
        ("unknown_event_type", json.dumps({**pick(), "event_type": "wishlist_add"})),
        ("amount_not_a_number", json.dumps({**pick(), "event_type": "purchase", "quantity": 1,
                                            "amount": "12,99 EUR"})),
    ]
    return bad


def generate(rows: int = 3000, seed: int = 42) -> tuple[list[str], dict]:
    rng = random.Random(seed)
    events = good_events(rng, rows)
    lines = [json.dumps(e, separators=(",", ":")) for e in events]
    bad = malformed_lines(rng, events)
    # Scatter the bad lines through the file, not at its end.
    positions = sorted(rng.sample(range(1, len(lines)), len(bad)), reverse=True)
    for pos, (_, line) in zip(positions, bad, strict=True):
        lines.insert(pos, line)
    kinds: dict[str, int] = {}
    for kind, _ in bad:
        kinds[kind] = kinds.get(kind, 0) + 1
    manifest = {
        "seed": seed,
        "lines": len(lines),
        "good": len(events),
        "malformed": len(bad),
        "malformed_kinds": kinds,
        "first_event_time": min(e["event_time"] for e in events),
        "last_event_time": max(e["event_time"] for e in events),
        "purchases": sum(1 for e in events if e["event_type"] == "purchase"),
        "revenue_eur": round(sum(e["amount"] for e in events if e["event_type"] in ("purchase", "refund")), 2),
    }
    return lines, manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3000, help="good events to generate (default 3000)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output JSON lines file (default jobs/data/events.jsonl)")
    args = parser.parse_args(argv)
    lines, manifest = generate(args.rows, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    manifest_path = os.path.splitext(args.out)[0] + ".manifest.json"
    with open(manifest_path, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(f"wrote {manifest['lines']} lines to {args.out}: {manifest['good']} events "
          f"({manifest['first_event_time']} .. {manifest['last_event_time']}), "
          f"{manifest['malformed']} malformed; manifest {manifest_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
