import json
from pathlib import Path

import msgspec
import pytest

from specpilot import schema, subjects
from tests.backbone.samples import one_of_each

GOLDEN = Path(__file__).parent.parent / "golden" / "events.jsonl"


def test_every_type_round_trips():
    samples = one_of_each()
    assert {type(e) for e in samples} == set(schema.ALL_EVENTS)
    for e in samples:
        data = schema.encode(e)
        back = schema.decode(data)
        assert back == e and type(back) is type(e)
        assert schema.encode(back) == data  # canonical: same bytes again


def test_tags_unique_and_sources_declared():
    tags = [t.__struct_config__.tag for t in schema.ALL_EVENTS]
    assert len(tags) == len(set(tags))
    for t in schema.ALL_EVENTS:
        assert t.sources and t.sources <= set(schema.SERVICES), t


def test_golden_file_decodes_and_covers_every_type():
    lines = GOLDEN.read_text().splitlines()
    decoded = [schema.decode(line.encode()) for line in lines]
    assert {type(e) for e in decoded} == set(schema.ALL_EVENTS)
    for line, e in zip(lines, decoded, strict=True):
        assert json.loads(line)["event_id"] == e.event_id


def test_decode_refuses_garbage_and_unknown_tags():
    for bad in (b"not json", b'{"type": "no.such.event"}', b'{"type": "patch.proposed", "patch_id": 3}', b"[]"):
        with pytest.raises(schema.DecodeError):
            schema.decode(bad)


def test_events_are_frozen():
    e = one_of_each()[0]
    with pytest.raises(AttributeError):
        e.round_id = "x"  # type: ignore[misc]


def test_event_ids_are_uuid7_and_time_ordered():
    ids = [schema.new_event_id(now_ns=t * 1_000_000) for t in (1_700_000_000_000, 1_700_000_000_001, 1_800_000_000_000)]
    assert ids == sorted(ids)
    for i in ids:
        assert i[14] == "7" and i[19] in "89ab" and len(i) == 36
    assert len({schema.new_event_id() for _ in range(1000)}) == 1000


def test_subjects_prove_sources():
    assert subjects.source_of("sp.ev.controller.verdict.issued") == "controller"
    assert subjects.source_of("sp.ev.nobody.x") is None
    assert subjects.source_of("sp.rpc.memory.sql") is None
    assert msgspec.json.decode(schema.encode(one_of_each()[0]))["type"] == "deployment.registered"
