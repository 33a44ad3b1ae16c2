"""The models-from-code file of gptlab's logged models: MLflow's `python_model`, so nothing is pickled.

MLflow copies this file into each logged model and runs it when the model loads,
with the gptlab package the model carries (`code_paths`) on sys.path; the model's
`model_config` ({"gptlab.model_kind": "spam" | "instruct" | "lm"}) picks the
pyfunc class of gptlab.serving.pyfunc_models. Like that module, it imports mlflow.
"""

from mlflow.models import set_model

from gptlab.serving.pyfunc_models import GptlabModel

set_model(GptlabModel())
