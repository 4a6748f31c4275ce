# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
# Both create .venv in the checkout (torch's pinned CPU wheel first, then the project with its
# extras), build the native interceptor and fake driver with the system C compiler, then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dilu-installed
ARGS   ?=

.PHONY: demo test native clean schema

# The project's own modules are compiled once, into __pycache__ (ignored by git), even where the
# environment sets PYTHONDONTWRITEBYTECODE: every test run and every process a test starts (services,
# instances, commands) would otherwise compile them again (pytest's collection took 18 s a run
# for 6.6 s, a service's start 0.92 s for 0.77).
demo test: export PYTHONDONTWRITEBYTECODE =

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[worker,dev]'
	$(PY) -m dilu.interceptor.build
	touch $(STAMP)

native: $(STAMP)
	$(PY) -m dilu.interceptor.build

demo: $(STAMP)
	$(VENV)/bin/dilu demo $(ARGS)

# Four phases, each a pytest run. The pure tests share both cores (pytest-xdist); then those that
# talk to a nats-server or to services but time nothing on the emulated device, also two at a time;
# then, one at a time, the native ones (the emulated device's timeline: beside another test a
# kernel-cycle baseline read 200 us for 2,000) and the live clusters (`slow`: a chaos replay ran
# late beside other tests); the `solo` ones last, alone. Marks: tests/conftest.py.
test: $(STAMP)
	$(PY) -m dilu.interceptor.build
ifeq ($(strip $(ARGS)),)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "not serial"
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist worksteal -m "serial and not native and not slow and not solo"
	$(PY) -m pytest -q -p no:cacheprovider -m "(native or slow) and not solo"
	$(PY) -m pytest -q -p no:cacheprovider -m solo
else
	$(PY) -m pytest -q -p no:cacheprovider $(ARGS)
endif

schema: $(STAMP)
	$(PY) -m dilu.contracts.schema --write

clean:
	rm -rf $(VENV) interceptor/build
