"""Several replicas' Prometheus expositions as one, each sample labelled with its replica.

Each metric family appears once (one ``# HELP`` and ``# TYPE``), with every replica's samples
under it; a sample keeps its own labels and gains ``replica="<id>"``. A replica's text that does
not parse is left out (and named in the log), never the whole answer.
"""

from __future__ import annotations

import logging
from typing import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

REPLICA_LABEL = "replica"


class _Families:
    """A collector that yields the merged families (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)


def merge_expositions(texts: Mapping[str, str], label: str = REPLICA_LABEL) -> bytes:
    """The Prometheus text of every replica's ``texts[replica]``, merged; see the module docstring."""
    merged: dict[str, Metric] = {}
    for replica in sorted(texts):
        try:
            families = list(text_string_to_metric_families(texts[replica]))
        except ValueError as error:
            logger.warning("replica %s: its metrics do not parse, left out: %s", replica, error)
            continue
        for family in families:
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            target.samples += [sample._replace(labels={**sample.labels, label: replica}) for sample in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
