"""Fixtures of the pipeline tier. `kfp_standin` and `kfp_multiuser` serve a STAND-IN for the
KFP v2beta1 REST API on a free loopback port, single-user and multi-user; it is not
Kubeflow Pipelines (see `kfp_standin`, the module). Each fails its test if the stand-in saw a
request or sent an answer that the API document does not allow (`rejected`)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kfp_standin import StandinState, serve


@dataclass
class KfpStandin:
    url: str
    state: StandinState

    @property
    def rejected(self) -> list[str]:
        return self.state.rejected

    @property
    def refused(self) -> list[str]:
        return self.state.refused


def _standin(multi_user: bool):
    state = StandinState(multi_user=multi_user)
    with serve(state) as url:
        yield KfpStandin(url, state)
    assert state.rejected == [], "requests or answers outside the KFP API document"


@pytest.fixture
def kfp_standin():
    """A single-user KFP 2.15.0 stand-in (see the module `kfp_standin`)."""
    yield from _standin(multi_user=False)


@pytest.fixture
def kfp_multiuser():
    """A multi-user KFP 2.15.0 stand-in: namespaces matter (see the module `kfp_standin`)."""
    yield from _standin(multi_user=True)
