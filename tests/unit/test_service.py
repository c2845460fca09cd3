"""Service classes: the mapping from a request's fields, keys, SLO specs."""

from __future__ import annotations

import pytest

from epdserve.errors import ConfigError
from epdserve.service import (
    DEFAULT_KEY,
    MAX_PRIORITY,
    SERVICE_CLASSES,
    ClassSLO,
    class_of_key,
    parse_class_slos,
    resolve,
    schedule_key,
)
from epdserve.validate import InvalidFieldError, check_service


@pytest.mark.parametrize("tier, priority, expected", [
    (None, None, "interactive"), (None, 0, "interactive"), (None, -3, "realtime"), (None, 7, "batch"),
    ("priority", None, "realtime"), ("default", 5, "interactive"), ("auto", None, "interactive"),
    ("flex", -5, "batch"),
])
def test_mapping(tier, priority, expected):
    name, key = resolve(tier, priority)
    assert name == expected and class_of_key(key) == expected


def test_class_rank_dominates_priority():
    keys = [schedule_key(c, p) for c in SERVICE_CLASSES for p in (-MAX_PRIORITY, 0, MAX_PRIORITY)]
    assert keys == sorted(keys) and DEFAULT_KEY == 0 == resolve(None, None)[1]
    assert all(class_of_key(schedule_key(c, p)) == c for c in SERVICE_CLASSES for p in (-MAX_PRIORITY, MAX_PRIORITY))


@pytest.mark.parametrize("tier, priority, param", [
    ("gold", None, "service_tier"), (3, None, "service_tier"), (None, 1.5, "priority"), (None, True, "priority"),
    (None, MAX_PRIORITY + 1, "priority"), (None, -MAX_PRIORITY - 1, "priority"), (None, 10**40, "priority"),
])
def test_bad_fields_are_400s(tier, priority, param):
    with pytest.raises(InvalidFieldError) as e:
        check_service(tier, priority)
    assert e.value.param == param


def test_class_slos():
    slos = parse_class_slos(["realtime=ttft:200,tpot:50", "batch=tpot:500"])
    assert slos == {"realtime": ClassSLO(0.2, 0.05), "batch": ClassSLO(None, 0.5)}
    assert slos["realtime"].is_met(0.1, 0.05) and not slos["realtime"].is_met(0.3, 0.01)
    assert not slos["realtime"].is_met(None, None) and slos["batch"].is_met(None, None)
    for bad in (["gold=ttft:1"], ["batch"], ["batch=ttft:0"], ["batch=ttft:x"], ["batch=itl:5"],
                ["batch=ttft:1,ttft:2"], ["batch=ttft:1", "batch=tpot:1"], ["batch=ttft:inf"]):
        with pytest.raises(ConfigError):
            parse_class_slos(bad)
