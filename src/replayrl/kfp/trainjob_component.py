"""The trainer task of `async_segment` when the trainers span nodes
(`asynchronous.trainer_nodes` > 1): a CPU pod that launches the segment's Kubeflow Trainer
TrainJob and waits for it (`replayrl.kfp.trainjob`). It keeps the one-host trainer's
component name, `async_trainer`, so its KFP task is `async-trainer`, the name the segment's
other roles look for (`replayrl.kfp.pending_peers.ROLE_TASK`). Built like the components of
`replayrl.kfp.components`; no `from __future__ import annotations` (KFP reads the real
annotation objects).
"""

from kfp import dsl
from kfp.dsl import Metrics, Output

from replayrl.kfp import DEFAULT_IMAGE

_COMPONENT = dict(base_image=DEFAULT_IMAGE, install_kfp_package=False)


@dsl.component(**_COMPONENT)
def async_trainer(config: str, owner: str, segment_id: str, metrics: Output[Metrics]):
    """The trainer on asynchronous.trainer_nodes nodes: creates the segment's TrainJob (or
    adopts it after a retry), waits until it is Complete, deletes it on SIGTERM; the ranks do
    the trainer's work. Logs the trainer's numbers from the board."""
    from replayrl.kfp import runtime, trainjob

    with runtime.user_errors_as_exit():
        trainjob.launch_trainer(config=config, owner=owner, segment_id=segment_id)
        numbers = trainjob.trainer_numbers(config)
    runtime.log_metrics(metrics, numbers)
