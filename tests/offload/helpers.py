"""What the offload tests share: copy engines and events they drive by hand, and the
dtypes a round trip must carry bit for bit."""
import weakref

import torch

from actsave.offload import CopyEngine, HostCopyEngine

KiB = 1024
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn]


class FakeEvent:
    """A copy's event whose completion the test decides."""

    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class RecordingEngine(HostCopyEngine):
    """Copies synchronously, logs what was asked, and keeps the sources it read and the
    events it handed out (which the test may mark unfinished). An offloaded tensor is
    named by its first element."""

    def __init__(self, log):
        self.log = log
        self.sources = []  # weak references
        self.events = []

    def to_host(self, source, host):
        super().to_host(source, host)
        self.sources.append(weakref.ref(source))
        return self._logged("to_host", host)

    def to_device(self, host):
        tensor, _ = super().to_device(host)
        return tensor, self._logged("to_device", host)

    def wait(self, event):
        self.log.append(("wait", event.name))

    def free_after(self, event):
        self.log.append(("free_after", event.name))

    def _logged(self, what, host):
        event = FakeEvent(done=True)
        event.name = int(host.flatten()[0])
        self.log.append((what, event.name))
        self.events.append(event)
        return event


class LateEvent:
    """The event of a :class:`LateCopyEngine` copy: finished once the engine ran it."""

    def __init__(self, engine, number):
        self.engine, self.number = engine, number

    def query(self):
        return self.engine.finished >= self.number

    def synchronize(self):
        self.engine.run_until(self.number)


class LateCopyEngine(CopyEngine):
    """Copies as a GPU running behind the host makes them: queued in order, and run only
    once something is ordered after them (``wait`` or ``free_after`` on their event or a
    later one: one copy stream) or the host waits for one (``synchronize``). What the
    host does to a source before then, the copy reads."""

    def __init__(self):
        self.queue, self.asked, self.finished = [], 0, 0

    def to_host(self, source, host):
        return self.to_host_all([(source, host)])

    def to_host_all(self, pairs):
        return self._queued(lambda: [host.copy_(source) for source, host in pairs])

    def to_device(self, host):
        target = torch.empty_like(host)
        return target, self._queued(lambda: target.copy_(host))

    def wait(self, event):
        self.run_until(event.number)

    def free_after(self, event):
        self.run_until(event.number)

    def run_until(self, number):
        while self.queue and self.queue[0][0] <= number:
            number_run, copy = self.queue.pop(0)
            copy()
            self.finished = number_run

    def _queued(self, copy):
        self.asked += 1
        self.queue.append((self.asked, copy))
        return LateEvent(self, self.asked)
