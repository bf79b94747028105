"""One run of a config: the strategy registry (:mod:`~userdp.run.registry`), the run's components
(:mod:`~userdp.run.components`), the run loop (:mod:`~userdp.run.loop`) and its outputs, and the
transports that drive its steps (:mod:`~userdp.run.in_process`, :mod:`~userdp.run.grpc_workers`,
:mod:`~userdp.run.flower`), chosen by :func:`userdp.run.launch.run`."""
