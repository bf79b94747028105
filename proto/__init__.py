"""The userdp wire protocol (``userdp.v1``): ``.proto`` sources and generated modules."""
