"""The paper's Table 1 (maximum model size): the experiment, its domain rows and its report."""
