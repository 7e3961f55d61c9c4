import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("PYTHONWARNINGS", "ignore")
warnings.filterwarnings("ignore")
