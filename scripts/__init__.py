"""Python helpers of the NSCLC-Radiomics SwinUNETR bundle, imported by the configs as ``scripts.<module>``."""
