"""What the coordinator says about what it refuses or loses: a result labelled with another step
(rejected at once, not left to time out), every lost worker, request bodies that are not protobuf
messages, the unauthenticated loopback mode, and the certificates it lacks."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
import torch
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.channels import PROTOCOL_VERSION
from userdp.server.aggregation import StepGather
from userdp.server.auth import Authorizer
from userdp.server.certs import make_dev_ca
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.registry import WorkerLost, WorkerSession
from userdp.server.runtime import INSECURE_WARNING, authorizer_from_config

from userdp.config import parse_config

from . import toy
from .harness import make_loopback, reference_params
from .standins import uls_strategy

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
GARBAGE = b"\x0a\xff\xff"  # field 1, length-delimited, with a truncated length
COORDINATOR_LOG = "userdp.server.coordinator"


def _messages(caplog, text: str, logger: str = COORDINATOR_LOG) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger and text in r.getMessage()]


class MislabelsItsFirstResult(toy.ToyCompute):
    """Answers its first task with a Result labelled with another step (the worker builds the
    Result's step from the task after computing)."""

    def __init__(self) -> None:
        super().__init__()
        self.mislabelled = False

    def compute(self, task):
        partial = super().compute(task)
        if not self.mislabelled:
            self.mislabelled = True
            task.step += 1000
        return partial


def test_a_result_labelled_with_another_step_is_rejected_and_reissued_at_once(tmp_path, caplog):
    # Deadlines far beyond the run: a discarded result would leave the step waiting for them.
    settings = CoordinatorSettings(step_deadline_s=600, task_deadline_s=500, worker_startup_s=300)
    loop = make_loopback(tmp_path, settings=settings)
    liar = MislabelsItsFirstResult()
    try:
        loop.add_worker("a-liar", ALL, compute=liar)
        loop.add_worker("b-honest", ALL)
        loop.wait_until_ready("a-liar")
        loop.wait_until_ready("b-honest")
        with caplog.at_level(logging.INFO, logger=COORDINATOR_LOG):
            reports = loop.coordinator.run(3)
    finally:
        loop.close()
    assert liar.mislabelled, "the liar was never given a task"
    (rejected,) = _messages(caplog, "labelled step")
    assert rejected.levelno == logging.WARNING
    message = rejected.getMessage()
    assert message.startswith("rejected ") and "from a-liar" in message
    assert "result labelled step 10" in message and "of step " in message
    assert not _messages(caplog, "timed out")
    assert sum(r.failed_tasks for r in reports) == 1
    expected = reference_params(uls_strategy(), loop.coordinator.population, 3)
    for name, value in loop.coordinator.params.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5)


def test_every_lost_worker_is_a_warning(tmp_path, caplog):
    loop = make_loopback(tmp_path)
    try:
        client = loop.add_worker("w0", ALL)
        loop.wait_until_ready("w0")
        with caplog.at_level(logging.INFO, logger=COORDINATOR_LOG):
            client.stop()  # between steps: the worker holds no task
            deadline = time.monotonic() + 120
            while not _messages(caplog, "worker w0 lost"):
                assert time.monotonic() < deadline, "the lost worker was never logged"
                loop.coordinator.pump_events(0.05)
            # during a step, without a task of that worker
            session = WorkerSession("w1", "s1", frozenset(ALL), pb.Capabilities(), 0)
            gather = StepGather(0, 0, [], {}, clip_norm=1.0)
            loop.coordinator._handle(WorkerLost(session, "stream ended"), gather)
    finally:
        loop.close()
    (lost,) = _messages(caplog, "worker w0 lost")
    assert lost.levelno == logging.WARNING
    (idle,) = _messages(caplog, "worker w1 lost")
    assert idle.levelno == logging.WARNING and idle.getMessage() == "worker w1 lost (stream ended)"


def _register(worker_id: str) -> bytes:
    population = toy.toy_population()
    message = pb.WorkerMessage(
        register=pb.Register(
            worker_id=worker_id,
            protocol_version=PROTOCOL_VERSION,
            shards=[pb.ShardHolding(name=n, sha256=h) for n, h in population.shard_sha256.items()],
            capabilities=pb.Capabilities(device="cpu", num_devices=1),
            model_version=-1,
        )
    )
    return message.SerializeToString()


def test_an_undecodable_request_body_is_one_warning_line(tmp_path, caplog):
    loop = make_loopback(tmp_path)
    try:
        with (
            grpc.insecure_channel(loop.server.address) as channel,
            caplog.at_level(logging.WARNING),
        ):
            report = channel.unary_unary("/userdp.v1.Coordinator/ReportStartup")
            with pytest.raises(grpc.RpcError) as refused:
                report(GARBAGE, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            connect = channel.stream_stream("/userdp.v1.Coordinator/Connect")
            with pytest.raises(grpc.RpcError) as refused:
                list(connect(iter([GARBAGE]), timeout=60))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # inside a session: the session ends (the stream closes), one line names the worker
            replies = list(connect(iter([_register("w-garbage"), GARBAGE]), timeout=60))
            assert replies and replies[0].startswith(b"\x0a")  # a Welcome came first
    finally:
        loop.close()
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in records] == ["userdp.server.service"] * 3, [
        (r.name, r.getMessage()) for r in records
    ]
    for record, method in zip(records, ["ReportStartup", "Connect", "Connect"], strict=True):
        message = record.getMessage()
        assert message.startswith(f"undecodable {method} message from ")
        assert "ipv4:127.0.0.1:" in message and "Error parsing message" in message
        assert "(3 bytes)" in message and "\n" not in message and record.exc_info is None
    assert "worker w-garbage (ipv4:127.0.0.1:" in records[2].getMessage()


def test_the_unauthenticated_loopback_mode_is_one_warning(tmp_path, caplog):
    assert INSECURE_WARNING == (
        "unauthenticated loopback mode: any local process can connect as a worker; set "
        "coordinator.tls_dir or coordinator.auth_token_file"
    )
    with caplog.at_level(logging.INFO, logger="userdp.server.runtime"):
        authorizer, tls = authorizer_from_config(parse_config({}).coordinator)
        assert authorizer == Authorizer.insecure() and tls is None
        token = tmp_path / "token"
        token.write_text("a-long-shared-token-value\n")
        config = parse_config({"coordinator": {"auth_token_file": str(token)}})
        authorizer, _ = authorizer_from_config(config.coordinator)
        assert authorizer.token is not None
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert messages == [(logging.WARNING, INSECURE_WARNING)]


def test_missing_coordinator_certificates_name_the_command_that_makes_them(tmp_path):
    make_dev_ca(tmp_path, ["worker-0"], days=1)  # no coordinator certificate
    config = parse_config({"coordinator": {"tls_dir": str(tmp_path)}}).coordinator
    with pytest.raises(ValueError) as missing:
        authorizer_from_config(config, ["worker-0", "worker-1"])
    message = str(missing.value)
    assert message.startswith(f"coordinator.tls_dir = {str(tmp_path)!r}: missing ")
    assert "coordinator.pem" in message and "coordinator.key" in message
    assert f"--out {tmp_path} --names coordinator,worker-0,worker-1`" in message
    assert "coordinator,coordinator" not in message and "\n" not in message
    with pytest.raises(ValueError) as missing:
        authorizer_from_config(config)
    assert "--names coordinator,<worker-id>,...`" in str(missing.value)
    make_dev_ca(tmp_path, ["coordinator", "worker-0"], days=1)
    authorizer, tls = authorizer_from_config(config)
    assert authorizer.mtls and tls is not None
