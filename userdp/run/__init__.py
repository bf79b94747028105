"""One run of a config: the strategy registry (:mod:`~userdp.run.registry`), the run's components
(:mod:`~userdp.run.components`), the run loop (:mod:`~userdp.run.loop`) and its outputs, and the
transports that drive its steps (:mod:`~userdp.run.in_process`, :mod:`~userdp.run.grpc_workers`,
chosen by :func:`userdp.run.launch.run`), and the step inside Flower (:mod:`~userdp.run.flower`,
which Flower's own run starts)."""
