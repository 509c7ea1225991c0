# The README's two commands: `make demo` and `make test`. Both create (or reuse) .venv/ with the pinned
# packages of requirements.txt, install this project into it (generating the ROS interfaces), then run.
# Safe to run again: each step is skipped when its inputs did not change.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-$(shell sha256sum requirements.txt | cut -c1-16)
PROJECT_STAMP := $(VENV)/.project-installed
PROJECT_SOURCES := $(shell find flashrt_core flashrt_bench flashrt_ros msg srv launch config scripts cmake -type f \
	-not -name '*.pyc' 2>/dev/null) setup.py CMakeLists.txt package.xml

# Keep every ROS participant on this machine unless the caller chose otherwise.
export ROS_AUTOMATIC_DISCOVERY_RANGE ?= LOCALHOST
ifndef ROS_DOMAIN_ID
export ROS_DOMAIN_ID := $(shell $(PYTHON) -c 'import random; print(random.randint(1, 200))')
endif
ifndef ROS_LOG_DIR
export ROS_LOG_DIR := $(shell mktemp -d /tmp/flashrt_roslog.XXXXXX)
endif
DEMO_ARGS ?=
TEST_ARGS ?=

.PHONY: demo test install venv clean

demo: $(PROJECT_STAMP)
	$(VENV)/bin/flashrt demo $(DEMO_ARGS)

test: $(PROJECT_STAMP)
	@rc=0; $(PY) -m pytest $(TEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the set-up is broken"; exit 1; fi; exit $$rc

install: $(PROJECT_STAMP)

venv: $(DEPS_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install -q pip==24.3.1
	$(PY) -m pip install -q -r requirements.txt
	@# `. .venv/bin/activate` then also gives the ament environment (launch_ros finds the package).
	@grep -q AMENT_PREFIX_PATH $(VENV)/bin/activate || \
	  echo 'export AMENT_PREFIX_PATH="$$VIRTUAL_ENV$${AMENT_PREFIX_PATH:+:$$AMENT_PREFIX_PATH}"' >> $(VENV)/bin/activate
	rm -f $(VENV)/.deps-*
	touch $@

$(PROJECT_STAMP): $(DEPS_STAMP) $(PROJECT_SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps .
	touch $@

clean:
	rm -rf build *.egg-info
