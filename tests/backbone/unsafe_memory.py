"""TEST ONLY: a memory service that acks before it commits, to prove the durability test can fail.

Run as ``python -m tests.backbone.unsafe_memory``. The pause between ack and commit stands for a slow
disk; with it, a SIGKILL at a random point lands between the two often enough to lose events.
"""

import asyncio

from specpilot.services.memory.main import Recorder, main


class AckBeforeCommit(Recorder):
    async def record(self, deliveries):
        from specpilot.services.memory import logic

        plan = logic.classify(deliveries)
        await self.acknowledge(plan)
        await asyncio.sleep(0.05)
        self.commit(plan)


if __name__ == "__main__":
    main(recorder_cls=AckBeforeCommit)
