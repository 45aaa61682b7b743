"""Where workers' collective calls first differ and whom that blames
(tracker/control/disagreement.py): the same worker every time, from what they called."""

from tracker.control import disagreement
from tracker.outcome import conclude
from tracker.process import ProcSpec

INIT = ("init", ("key 0 (3,) float32", "key 1 (4, 4) float32"))


def test_two_workers_blame_worker_1_at_the_first_item_that_differs():
    text = disagreement.describe({0: INIT, 1: ("init", ("key 0 (3,) float32", "key 1 (4, 5) float32"))})
    assert text == ("workers disagree at a collective call (init): worker 1 differs from worker 0 at item 1 "
                    "(of 2): worker 0 has key 1 (4, 4) float32, worker 1 has key 1 (4, 5) float32")
    assert disagreement.blamed(f"worker 0 (pid 1 on h) failed: InvalidArgumentError: {text}") == ["worker 1"]
    # a worker whose exchange the abort cut short raises what the others quote
    assert disagreement.quoted(f"worker 0 (pid 1 on h) failed: InvalidArgumentError: {text}") == text
    assert disagreement.quoted("worker 0 (pid 1 on h) failed: ValueError: workers disagree at a collective "
                               "call, says the user") is None
    assert disagreement.quoted(None) is None


def test_the_majority_call_is_the_reference_and_every_odd_worker_is_named():
    odd = ("init", ("key 0 (3,) float32",))
    text = disagreement.describe({0: odd, 1: INIT, 2: INIT, 3: odd, 4: INIT})
    assert text == ("workers disagree at a collective call (init): worker 0 differs from worker 1 (so do worker 3) "
                    "at item 1 (worker 1 has 2, worker 0 1): worker 1 has key 1 (4, 4) float32, worker 0 has "
                    "no item 1 (it has 1)")


def test_different_calls_are_named_and_equal_calls_are_no_disagreement():
    text = disagreement.describe({0: INIT, 1: ("set_optimizer sgd", ())})
    assert text == ("workers disagree at a collective call: worker 1 differs from worker 0: worker 0 called "
                    "'init' with 2 items, worker 1 called 'set_optimizer sgd'")
    assert disagreement.describe({0: INIT, 1: INIT}) is None
    assert disagreement.decode(disagreement.encode(*INIT)) == INIT


def test_the_launcher_marks_the_blamed_worker_whichever_reported_first():
    children = [type("Ended", (), {"spec": ProcSpec("worker", r, ("x",)), "pid": 100 + r, "poll": lambda self: 1})()
                for r in range(3)]
    text = disagreement.describe({0: INIT, 1: INIT, 2: ("init", ())})
    for reporter in range(3):
        failure = f"worker {reporter} (pid {100 + reporter} on h) failed: InvalidArgumentError: {text}"
        outcome = conclude(children, {f"worker {r}": 1 for r in range(3)}, ("scheduler", 1), None, failure)
        assert [row[0] for row in outcome.rows if row[3] == "root cause"] == ["worker 2"], failure
        assert outcome.root_cause.startswith("worker 2 differs from the other workers at a collective call")


def test_the_schedulers_own_answer_blames_the_same_worker_as_the_exchange_would():
    """When the exchange cannot complete, the scheduler's answer (each worker's token)
    still blames the worker the exchange would, and the launcher marks it."""
    from tracker.control.records import Barrier, Node
    nodes = {f"w{r}": Node(node_id=f"w{r}", role="worker", rank=r, host="h", pid=100 + r, addr="", ident=b"",
                           last_seen=0.0) for r in range(3)}
    barrier = Barrier()
    for r, token in enumerate(["init a", "init b", "init b"]):
        barrier.arrive(f"w{r}", f"w{r}".encode(), r, token, 10.0, 0.0, nodes)
    sends = barrier.release(list(nodes.values()), nodes)
    text = sends[0].fields["message"]
    assert text == ("workers disagree at a collective call: worker 0 differs from worker 1: worker 0: 'init a'; "
                    "worker 1: 'init b'; worker 2: 'init b'")
    assert disagreement.blamed(f"worker 2 (pid 102 on h) failed: InvalidArgumentError: a barrier failed: {text}") \
        == ["worker 0"]
