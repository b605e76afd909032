"""Lightning DDP on CPU (gloo, two processes) with PaperDebuggerCallback: every rank records its
own group into the same path.

    python lightning_ddp.py RUN

Lightning's launcher runs this script again for rank 1, with the same arguments.
"""

import sys
import warnings

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from recorder.lightning import PaperDebuggerCallback


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[PaperDebuggerCallback(sys.argv[1])])
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(24, 4)), batch_size=2))
